import sys

from kvmerge.bench import main

sys.exit(main())
