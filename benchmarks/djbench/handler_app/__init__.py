"""The application table the ORM-handler workloads read and update (run.py orm, atomic).

Named ``handler_app`` / ``HandlerAccount`` so it can sit beside other
benchmark apps with an ``Account`` model.
"""
