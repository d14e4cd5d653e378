"""``python -m flatshard.plan MODULE:CALLABLE [options]``: print the plan (see ``flatshard.plan``)."""

from . import main

main()
