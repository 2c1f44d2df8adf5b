"""Repricing: a new version of a cost model recorded, priced against the traffic it would
reprice (capacity.pricing.review), then activated, held for a planner, rejected or retired
(services.py)."""
