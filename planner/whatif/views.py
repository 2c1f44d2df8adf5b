from django.shortcuts import render

from planner.access import planner_required


@planner_required
def index(request):
    return render(request, "planner/placeholder.html", {"section": "whatif"})
