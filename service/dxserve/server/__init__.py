"""The service around the library: the ``Service``, workers, admission, the registry, stores, jobs and sandboxes."""
