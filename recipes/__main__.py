import sys

from recipes.cli import main

sys.exit(main())
