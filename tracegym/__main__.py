import sys

from tracegym.cli import main

sys.exit(main())
