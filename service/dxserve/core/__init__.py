"""The library's core: operators, engines and their fallbacks, preparation, chunking and budgets, written against the ``Framework`` seam alone."""
