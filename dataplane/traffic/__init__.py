"""Demo traffic: real LLM traces replayed through a gateway as its customers (`python -m
dataplane.traffic`, see replay.py and dataplane/README.md). No Django."""
