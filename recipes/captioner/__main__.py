import sys

from recipes.captioner.trainer import main

sys.exit(main())
