import sys

from zeroedu.cli import main

sys.exit(main())
