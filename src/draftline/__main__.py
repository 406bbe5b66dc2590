import gc
import sys

from draftline.cli import main

code = main()
# The command's work is done and its files are closed: the collector's walks over the objects of torch and transformers
# at interpreter exit took ~1 s per process on two cores (every rank of a launch, every command a script runs). What
# is garbage now is collected here; what lives until exit is left to the exit's own teardown, not walked again.
gc.collect()
gc.freeze()
sys.exit(code)
