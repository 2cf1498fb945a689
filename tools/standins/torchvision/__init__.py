# transformers reads the version of any torchvision it finds; keep it below 0.27.
from _importonly_standin import standin

standin(__name__, globals(), __version__="0.26.0")
