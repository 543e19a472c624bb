"""Complete jobs built on the ``fusion`` library, kept apart from it (run from the repository
root): ``python -m recipes.captioner`` trains an early-fusion captioner from scratch."""
