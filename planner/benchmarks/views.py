from django.shortcuts import render

from planner.access import planner_required


@planner_required
def runs(request):
    return render(request, "planner/placeholder.html", {"section": "benchmarks"})
