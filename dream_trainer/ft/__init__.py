"""Fault tolerance across replica groups (torchft): the groups' manager, where their sockets
listen, the gradient reduction across them, and the state a recovering group copies from a
live peer (in a format of its own, never a pickle).

Nothing here imports torchft at import time; ``FaultTolerantMixin`` is the way in.
"""
