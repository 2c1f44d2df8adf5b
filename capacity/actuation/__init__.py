"""Actuators push replica targets to the data plane, one module per kind."""
