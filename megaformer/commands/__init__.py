"""The sub-commands of ``megaformer``, one module each (as ``fairseq_cli/`` sits beside ``fairseq/``).

Every module has ``add_arguments(parser)`` and ``main(args) -> int``, registered in
:data:`megaformer.cli.COMMANDS`. A command parses its options (typed and checked by
:mod:`megaformer.cli_args`), validates what only the command line can get wrong (an
output over an input, options that go together), and calls the library with typed
values: no argparse namespace goes below this layer, and no library logic lives here.
``python -m megaformer.commands.demo`` (``make demo``) is the one module run on its own.
"""
