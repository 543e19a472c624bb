import sys

from fusion.training.cli import main

sys.exit(main())
