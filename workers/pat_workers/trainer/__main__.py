"""`python -m pat_workers.trainer ...`: one trainer rank, as `pat trainer` (launch.py) starts them."""

from .loop import main

main()
