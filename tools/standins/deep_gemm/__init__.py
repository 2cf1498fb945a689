from _importonly_standin import standin

standin(__name__, globals())
