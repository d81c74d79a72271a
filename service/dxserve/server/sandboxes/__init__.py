"""Bounded child processes, and the two jobs done in them: reading uploads and detecting sparsity."""
