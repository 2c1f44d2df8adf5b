"""The error handler itself never raises, whatever state the rows it describes are in."""

import pytest
from django.db import DataError, IntegrityError
from django.db.models import ProtectedError

from capacity.models import GpuPool, GpuType
from core.api.errors import api_exception_handler

pytestmark = pytest.mark.django_db


def test_a_protected_row_whose_relation_was_deleted_meanwhile_is_named_by_model_and_id(
    gpu_type,
):
    # The pool's __str__ reads its GPU type, which another request has just deleted.
    gone = GpuPool(pk=41, name="orphan", gpu_type_id=gpu_type.pk + 1000, gpu_count=1)
    with pytest.raises(GpuType.DoesNotExist):
        str(gone)
    kept = GpuPool.objects.create(name="kept", gpu_type=gpu_type, gpu_count=2)

    response = api_exception_handler(ProtectedError("in use", {gone, kept}), {})

    assert response.status_code == 409
    error = response.data["error"]
    assert error["code"] == "in_use"
    assert error["details"]["in_use_by"] == ["gpu pool 41", "kept (2× H100-80GB)"]


def test_deleting_a_gpu_type_whose_pool_vanishes_meanwhile_is_a_409_not_a_500(
    planner_client, pool, monkeypatch
):
    def vanished(self):
        raise GpuType.DoesNotExist("deleted by another request")

    monkeypatch.setattr(GpuPool, "__str__", vanished)
    response = planner_client.delete(f"/api/v1/gpu-types/{pool.gpu_type.name}/")
    assert response.status_code == 409
    assert response.json()["error"]["details"]["in_use_by"] == [f"gpu pool {pool.pk}"]
    assert GpuType.objects.filter(pk=pool.gpu_type_id).exists()


def test_an_integrity_error_without_a_message_is_still_a_409():
    response = api_exception_handler(IntegrityError(), {})
    assert response.status_code == 409
    assert response.data["error"]["code"] == "conflict"


def test_a_value_the_database_refuses_is_a_400_not_a_500():
    # The net under a bound forgotten at the edge: every input is bounded before the database.
    response = api_exception_handler(DataError("value too long for type character varying"), {})
    assert response.status_code == 400
    assert response.data["error"]["code"] == "out_of_range"
