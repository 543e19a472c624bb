import sys

from recipes.captioner.cli import main

sys.exit(main())
