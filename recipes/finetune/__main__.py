import sys

from recipes.finetune.cli import main

sys.exit(main())
