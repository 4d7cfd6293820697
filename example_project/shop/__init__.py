"""The example shop: orders charged, receipted, shipped and refunded by django-awa jobs.

``jobs.py`` declares the kinds, ``followups.py`` chains them, and
``manage.py awa_demo`` runs the whole thing against a live worker.
"""
