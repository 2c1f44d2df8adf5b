"""The data plane's own processes, which the control plane never imports: the engine emulator
(`emulator/`) and the GPU-host process supervisor (`supervisor/`). No Django here; only the
pure modules of the control plane (the replica profile in `simulation.engine`) are used.
"""
