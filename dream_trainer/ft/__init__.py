"""Fault tolerance across replica groups (torchft): the groups' manager, the gradient
reduction across them, and the state a recovering group copies from a live peer.

Nothing here imports torchft at import time; ``FaultTolerantMixin`` is the way in.
"""
