"""What leaves the machine: environment capture, bug reports, replay, checkpoint conversion."""
