from controlplane.celery import app


def test_celery_speaks_json_only_to_the_configured_redis(settings):
    conf = app.conf
    assert conf.broker_url == settings.REDIS_URL
    assert conf.task_serializer == "json"
    assert conf.accept_content == ["json"]
    assert conf.task_time_limit > conf.task_soft_time_limit > 0
    assert conf.beat_scheduler == "django_celery_beat.schedulers:DatabaseScheduler"
    assert {queue.name for queue in conf.task_queues} == {
        "default",
        "allocation",
        "benchmarks",
        "health",
    }
    assert conf.task_default_queue == "default"
