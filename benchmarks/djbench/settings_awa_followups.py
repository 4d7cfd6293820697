"""django-awa with an on_completed follow-up for every bench job.

Same as settings_awa plus the app whose followups.py declares it; only the
worker of the follow-up drain runs with these settings.
"""

from djbench.settings_awa import *  # noqa: F403
from djbench.settings_awa import INSTALLED_APPS as _APPS

INSTALLED_APPS = [*_APPS, "djbench.awa_followups"]
