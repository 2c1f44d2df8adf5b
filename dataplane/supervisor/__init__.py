"""The GPU-host agent: runs the operator's engine processes at the replica count the process
actuator asks for (`supervisor.py`), behind a small HTTP API (`server.py`).

Started with `python -m dataplane.supervisor`; plain Python, no Django.
"""
