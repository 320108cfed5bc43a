"""Worker processes: what each DataLoader worker runs at start, how workers and builders die with
their parent, descriptors held across a fork, and the memory a worker grows by.

May import: nothing in recipes.common but `loader_warning`.
"""
