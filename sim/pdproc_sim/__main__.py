import sys

from pdproc_sim import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
