"""The end-to-end harness: real ``launch_server`` processes serving tiny generated checkpoints.

A test harness, never product: the serving docs tell users to install upstream's real
dependencies. ``server`` starts and stops one server process and talks to it over HTTP;
``checkpoints`` writes the tiny models it serves (nothing is downloaded).
"""
