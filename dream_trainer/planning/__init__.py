"""Planning a large run on one CPU (``dream-trainer plan``): what a simulated rank holds
(``memory``) and sends (``comms``), and the report of a plan (``report``)."""
