import sys

from kvmerge.cli import main

sys.exit(main())
