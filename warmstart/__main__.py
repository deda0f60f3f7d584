import sys

from warmstart.launcher import main

sys.exit(main())
