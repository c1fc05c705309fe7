"""``python -m gpudiag`` runs the command-line interface."""

from gpudiag.cli import main

if __name__ == "__main__":
    main()
