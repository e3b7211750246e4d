"""The ``kvbridge-bench`` command line: one module per subcommand."""
