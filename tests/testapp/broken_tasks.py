"""A task module of an installed app that fails to import (not with an ImportError).

A worker imports it on demand for a job of kind ``task:tests.testapp.broken_tasks.<name>``
(tests/test_worker.py): the error must reach the job, not only the worker's log.
"""

raise TypeError("tests.testapp.broken_tasks cannot be imported")
