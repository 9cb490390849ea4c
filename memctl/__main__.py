import sys

from memctl.cli import main

sys.exit(main())
