import sys

from tandem.cli.main import main

sys.exit(main())
