import sys

from pcie_a2a.cli import main

sys.exit(main())
