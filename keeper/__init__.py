"""The keeper (worker 0): holds the node's share of the schedule in memory.

``classes`` gives each route × cadence × source × sitemap combination a small
id; ``buckets`` holds key → (due minute, class, version) and, per class, the
rows in due-minute order, so the best K due rows are a merge over class heads
and queue state costs the number of classes, not rows. ``process`` is the
``Keeper`` that feeds them from the store's change feed and publishes the
ready set (its concerns in ``feed``, ``publish``, ``verify``, ``report``, its
state in ``base``); ``loop`` is ``python -m keeper``, the process's loop, and
``ask`` the channel workers ask it questions over.
"""
