import sys

from hetspmd.cli import main

sys.exit(main())
