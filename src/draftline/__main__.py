import sys

from draftline.cli import main

sys.exit(main())
