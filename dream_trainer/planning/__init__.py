"""Planning a large run on one CPU: simulated ranks on torch's fake backend (``dream-trainer plan``)."""
