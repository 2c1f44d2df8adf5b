import gc
import os

from django.core.wsgi import get_wsgi_application
from django.urls import get_resolver

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
application = get_wsgi_application()

# What lives as long as the process (Django, the apps, the URL conf and every view, serializer
# and model it imports, loaded here rather than by the first request) goes into the garbage
# collector's permanent generation: its full collections no longer walk the hundreds of
# thousands of objects on every pass. A usage batch of 5,000 events allocates enough to set off
# several a request: in process (bench_usage's batches through the view, one thread) 19.4 us of
# CPU an event before, 13.7 after (27.0 before the decoded events were untracked too:
# capacity/metering/events.py, UsageEventStruct).
get_resolver().url_patterns  # noqa: B018 - imports the URL conf
gc.freeze()
