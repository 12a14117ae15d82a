"""What hybridfl changes in Flower, or reads from under its public API: all of it here, so that a maintainer sees in
one place what a new Flower may break.

- ``superexec`` and ``fork_server``: the warm executor, Flower's SuperExec with each ClientApp task forked from a
  process that imported torch once (the command: ``python -m client_app.warm_executor``); both it and the
  ServerApp's SuperExec (``python -m server_app.superexec``) ask a task poll answered 5xx again rather than exit,
  and poll every 1 s rather than 0.2 once idle;
- ``supernode``: Flower's SuperNode loop with its fixed waits paced and its heartbeat spaced (the command:
  ``python -m client_app.supernode``);
- ``control``: SuperNode keys registered, and a run's status read, through the Control API from the launcher's
  process (``flwr supernode register`` and ``flwr ls`` are a process each);
- ``replies``: a deployment's replies pulled through the ServerAppIo API one download per reply, and pushes retried;
- ``engine``: the in-process engine's ``Run`` record and the ServerApp's message identity;
- ``wire``: a record's bytes as Flower's transport pushes them.

Each module names the internals it relies on in ``RELIES_ON`` (``"module:attribute"``) and, where a name cannot say
it (a source line it patches, an argument it passes), a ``check()`` returning what moved;
tests/test_flower_internals.py runs both against the installed Flower and fails naming each one. The product pins
``flwr<1.43`` (docs/design/flower-internals.md: what the 1.43 development line breaks).

Nothing of hybridfl is imported by this package: it is the bottom of the import graph, and the warm executor's files
run in a device container that has Flower but not hybridfl.
"""

MODULES = ("control", "engine", "fork_server", "replies", "superexec", "supernode", "wire")
