import sys

from fulcrum.cli import main

sys.exit(main())
