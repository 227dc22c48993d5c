"""Django settings, read from the environment (see README "Configuration"); defaults run on one laptop."""

from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import plotly
from django.core.exceptions import ImproperlyConfigured

from engine.runtime.detection import detection_window
from webapp.env import (
    WILDCARDS,
    database_config,
    env_bool,
    env_dir,
    env_host,
    env_int,
    env_list,
    env_port,
    env_seconds,
    env_str,
    is_loopback,
    lab_certificate,
    redis_url,
    secret_key,
    site_url,
)

BASE_DIR = Path(__file__).resolve().parent.parent
# Runtime files: SQLite database, dev secret key, embedded Redis, agents' credentials, job files, collected static.
VAR_DIR = env_dir("ASTEROID_VAR_DIR", BASE_DIR / "var")  # created when missing

# Serving a lab (docs/deployment.md): the address the site, its agents' socket and the jobs' store gateway listen on,
# and the URL boards reach it at (the enrollment command names it, whatever address a browser used).
ASTEROID_HOST = env_host("ASTEROID_HOST", "127.0.0.1")
ASTEROID_PORT = env_port("ASTEROID_PORT", 8000)
_ON_LAN = not is_loopback(ASTEROID_HOST)
# On a LAN address the site serves HTTPS and wss (webapp/sitetls.py), plain HTTP only when ASTEROID_TLS=0 says so;
# on loopback plain HTTP unless ASTEROID_TLS=1. ASTEROID_TLS_OWN: the lab's own certificate, key and CA, or None.
ASTEROID_TLS = env_bool("ASTEROID_TLS", _ON_LAN)
ASTEROID_TLS_OWN = lab_certificate()
ASTEROID_SITE_URL = site_url(ASTEROID_HOST, ASTEROID_PORT, scheme="https" if ASTEROID_TLS else "http")
# Debug pages show settings and code to whoever asks: off by default on a LAN address, and refused there unless
# ASTEROID_DEBUG_ON_LAN=1 says the administrator means it.
DEBUG = env_bool("DJANGO_DEBUG", not _ON_LAN)
if DEBUG and _ON_LAN and not env_bool("ASTEROID_DEBUG_ON_LAN", False):
    raise ImproperlyConfigured(
        f"DJANGO_DEBUG=1 with ASTEROID_HOST={ASTEROID_HOST} would show debug pages (settings, code) to anyone on the "
        "LAN: unset DJANGO_DEBUG (it is off by default there), or set ASTEROID_DEBUG_ON_LAN=1 if you mean it"
    )
# Without DJANGO_SECRET_KEY, development and a lab's `make run` keep one generated in the var dir; an explicit
# DJANGO_DEBUG=0 (a production deployment) must set it.
SECRET_KEY = secret_key(DEBUG or not env_str("DJANGO_DEBUG"), VAR_DIR / "secret_key")
# The site answers to the names it is served at, besides any listed in DJANGO_ALLOWED_HOSTS.
_served_at = [h for h in (ASTEROID_HOST, urlsplit(ASTEROID_SITE_URL).hostname) if h and h not in WILDCARDS]
ALLOWED_HOSTS = list(dict.fromkeys(env_list("DJANGO_ALLOWED_HOSTS", ["127.0.0.1", "localhost"]) + _served_at))
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "daphne",  # first: makes `manage.py runserver` serve ASGI like `make run`
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "axes",  # login throttling and the log of failed logins (below)
    "webapp.accounts",
    "webapp.devices",
    "webapp.jobs",
    "webapp.catalog",
    "webapp.front",
]

MIDDLEWARE = [
    "webapp.accounts.api_errors.ApiErrors",  # first: it sees every /api/ error, whichever layer made it
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "webapp.front.errors.PageErrors",  # a page's 404 is the site's page, never DEBUG's list of URL patterns
    "axes.middleware.AxesMiddleware",  # last: turns a locked-out login into the lockout page
]

ROOT_URLCONF = "webapp.urls"
WSGI_APPLICATION = "webapp.wsgi.application"
ASGI_APPLICATION = "webapp.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# On PostgreSQL each site process pools at most this many connections (however many coordinator threads and
# sockets it runs: they give theirs back between uses); 0: none (a connection per thread, e.g. behind PgBouncer).
ASTEROID_DB_POOL_SIZE = env_int("ASTEROID_DB_POOL_SIZE", 10, minimum=0)
DATABASES = {
    "default": database_config(
        env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'db.sqlite3'}"), pool_size=ASTEROID_DB_POOL_SIZE
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several processes write at once (daphne's agent sockets, the Celery worker): WAL lets readers go on
    # while one writes, IMMEDIATE transactions take the write lock up front (a deferred one that upgrades
    # fails with "database is locked" without waiting), and a writer waits up to 20 s for the lock.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

# Login throttling (django-axes): 5 failed logins for one username from one IP address lock that pair out for 15
# minutes (any attempt while locked starts the 15 minutes again); a success clears the count. Every failure is logged
# (warning "AXES: ... login failure") and kept in the database (admin: Axes; `manage.py axes_reset_username USER`
# unlocks). Only password logins pass through it: API tokens and the agents' credentials never call authenticate().
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = 5
AXES_COOLOFF_TIME = timedelta(minutes=15)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]  # the pair: a guesser elsewhere cannot lock a user out
AXES_RESET_ON_SUCCESS = True
AXES_ENABLE_ACCESS_FAILURE_LOG = True
AXES_SENSITIVE_PARAMETERS = []  # the log line names the username and address, as sshd's does; never the password
AXES_LOCKOUT_CALLABLE = "webapp.accounts.views.locked_out"
AXES_VERBOSE = False  # no banner on stderr at every start: errors of the launcher stay one line

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
# plotly.js is served from the plotly package itself (static/vendor/plotly/plotly.min.js): no CDN, and the
# browser's plotly.js is always the one the server's figures were made for.
STATICFILES_DIRS = [BASE_DIR / "static", ("vendor/plotly", Path(plotly.__file__).parent / "package_data")]
STATIC_ROOT = VAR_DIR / "static"

# Redis carries Celery's broker and results and the Channels layer. Empty: `make run` starts an embedded
# redis-server and passes its URL to the processes it launches (see webapp/startsite.py).
REDIS_URL = redis_url()

# Without it (a bare `manage.py` command outside `make run`) there is no channel layer rather than a fake one;
# only tests/conftest.py substitutes in-memory ones.
if REDIS_URL:
    # redis-py 8 reads with a 5 s socket timeout by default, exactly as long as channels_redis blocks waiting for
    # a message (BZPOPMIN, 5 s): an idle consumer's read then times out and its socket is closed (1011).
    # redis-py's asyncio pool refuses a connection past max_connections (100 by default) instead of waiting: a
    # lab's agents all reconnecting at once (a daphne process restarted) each join their group at the same time.
    host = {"address": REDIS_URL, "socket_timeout": 30, "max_connections": 5000}
    # A socket's channel holds up to 1000 messages (channels_redis drops what a full one is sent, silently): a
    # browser on a fast job gets one per agent batch, and falls that far behind only when daphne is overloaded.
    CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [host], "capacity": 1000}}
    }
    # one cache for every site process (the link probes' turn, webapp.devices.api.link_slot)
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}}
else:
    CHANNEL_LAYERS = {}

CELERY_BROKER_URL = REDIS_URL or None
CELERY_RESULT_BACKEND = REDIS_URL or None
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_TASK_TIME_LIMIT = env_int("ASTEROID_TASK_TIME_LIMIT", 3600, minimum=1)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Celery 6's default (no task here acknowledges late, so none is affected), and its warning at each lost broker gone
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = True
CELERY_BEAT_SCHEDULE = {
    "health-check": {"task": "webapp.jobs.tasks.health_check", "schedule": env_int("ASTEROID_HEARTBEAT_S", 5, 1)},
    "compact-steps": {"task": "webapp.jobs.tasks.compact_steps", "schedule": 60},
}
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")

# Devices and runs (README "Configuration").
ASTEROID_HEARTBEAT_S = env_int("ASTEROID_HEARTBEAT_S", 5, minimum=1)  # agents send one this often
ASTEROID_HEALTH_KEEP_H = env_int("ASTEROID_HEALTH_KEEP_H", 24, minimum=1)  # devices' health samples no job keeps
ASTEROID_MISSED_HEARTBEATS = 3  # a device this many heartbeats late is offline
ASTEROID_ACCEPT_TIMEOUT_S = env_int("ASTEROID_ACCEPT_TIMEOUT_S", 60, minimum=1)  # for agents to accept a launch
# Jobs' stores listen on loopback only; the boards reach them through the coordinators process's store gateway
# (workers/storelink.py), which admits only a job's own devices, on this one fixed port of ASTEROID_HOST.
ASTEROID_STORE_PORT = env_port("ASTEROID_STORE_PORT", ASTEROID_PORT + 1 if ASTEROID_PORT < 65535 else 8001)
# The address agents reach the gateway at: the site URL's host unless told otherwise (a proxy in between).
ASTEROID_STORE_HOST = env_str("ASTEROID_STORE_HOST", urlsplit(ASTEROID_SITE_URL).hostname or "127.0.0.1")
# A device process whose heartbeats stop this long is lost: by default what a LAN can deliver (a heartbeat stuck
# behind a full link queue, a 2 s link outage ridden out by TCP's retransmissions; engine.runtime.detection).
ASTEROID_DETECT_S = env_seconds("ASTEROID_DETECT_S", round(detection_window(), 1), minimum=0.5)
# Each device of a job reports the steps (its live timeline, its trace) of at most one iteration per this many
# seconds; 0: of every iteration (webapp/jobs/coordinating.py run_options; engine RunOptions.steps_every_s).
ASTEROID_STEPS_EVERY_S = env_seconds("ASTEROID_STEPS_EVERY_S", 1.0, minimum=0.0)
ASTEROID_RUN_TIMEOUT_S = env_int("ASTEROID_RUN_TIMEOUT_S", 60, minimum=1)  # the runtime's rendezvous timeout
# A coordinators process holds a lease on each job it runs, renewed a few times per lease; one that dies has its
# jobs taken over by another process this long after its last renewal (webapp/jobs/leases.py).
ASTEROID_LEASE_S = env_seconds("ASTEROID_LEASE_S", 6.0, minimum=1.0)
# How many coordinators processes `make run` starts (each with its store gateway on the next port from
# ASTEROID_STORE_PORT); more than one takes PostgreSQL (docs/deployment.md).
ASTEROID_COORDINATORS = env_int("ASTEROID_COORDINATORS", 1, minimum=1)
if ASTEROID_COORDINATORS > 1 and DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    raise ImproperlyConfigured(
        f"ASTEROID_COORDINATORS={ASTEROID_COORDINATORS} needs PostgreSQL (DATABASE_URL=postgres://...): SQLite "
        "takes one writer at a time"
    )
# The store gateways (one per coordinators process, from ASTEROID_STORE_PORT on) and the site need ports of their own.
if ASTEROID_STORE_PORT <= ASTEROID_PORT < ASTEROID_STORE_PORT + ASTEROID_COORDINATORS:
    _ports = f"ASTEROID_STORE_PORT={ASTEROID_STORE_PORT} and ASTEROID_PORT={ASTEROID_PORT} must differ"
    if ASTEROID_COORDINATORS > 1:
        _ports = (f"ASTEROID_PORT={ASTEROID_PORT} must not be one of the store gateways' ports {ASTEROID_STORE_PORT}-"
                  f"{ASTEROID_STORE_PORT + ASTEROID_COORDINATORS - 1}")  # fmt: skip
    raise ImproperlyConfigured(f"{_ports}; unset ASTEROID_STORE_PORT (the default is ASTEROID_PORT + 1) or change it")
# How many daphne processes serve ASTEROID_PORT (one listening socket, shared) and how many Celery workers plan
# jobs (docs/deployment.md); the channel layer is on Redis, the sessions in the database: any serves any request.
ASTEROID_DAPHNES = env_int("ASTEROID_DAPHNES", 1, minimum=1)
ASTEROID_CELERY_WORKERS = env_int("ASTEROID_CELERY_WORKERS", 1, minimum=1)
ASTEROID_AGENT_MAX_MESSAGE = 256 * 1024  # bytes of one agent message; larger ones are rejected
# Events one agent may send per second on average (twice that in a burst); more wait, none are lost.
ASTEROID_AGENT_EVENTS_PER_S = env_int("ASTEROID_AGENT_EVENTS_PER_S", 1000, minimum=1)
ASTEROID_MAX_PART_BYTES = env_int("ASTEROID_MAX_PART_BYTES", 2 * 1024**3, minimum=1)  # one uploaded model part
ASTEROID_JOBS_DIR = VAR_DIR / "jobs"  # each job's uploaded parts and assembled model

# Production (DJANGO_DEBUG=0): HTTPS-only cookies, HSTS and redirects, each switchable for a TLS-terminating proxy.
# A LAN site its administrator chose to serve on plain HTTP (ASTEROID_TLS=0) has no HTTPS to redirect to.
_PLAIN_BY_CHOICE = _ON_LAN and not ASTEROID_TLS
if not DEBUG:
    SECURE_SSL_REDIRECT = env_bool("DJANGO_SECURE_SSL_REDIRECT", not _PLAIN_BY_CHOICE)
    SESSION_COOKIE_SECURE = env_bool("DJANGO_SECURE_COOKIES", not _PLAIN_BY_CHOICE)
    CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE
    SECURE_HSTS_SECONDS = env_int("DJANGO_SECURE_HSTS_SECONDS", 31536000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
    SECURE_HSTS_PRELOAD = env_bool("DJANGO_SECURE_HSTS_PRELOAD", False)
    if env_bool("DJANGO_BEHIND_PROXY", False):
        SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SESSION_COOKIE_HTTPONLY = True

# Alerts by e-mail (webapp/jobs/alerts.py): through the SMTP server DJANGO_EMAIL_HOST names, else written to the
# site's log (a lab without a mail server still sees what would have gone out).
EMAIL_HOST = env_str("DJANGO_EMAIL_HOST", "")
EMAIL_PORT = env_int("DJANGO_EMAIL_PORT", 25, 1)
EMAIL_HOST_USER = env_str("DJANGO_EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("DJANGO_EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("DJANGO_EMAIL_USE_TLS", False)
DEFAULT_FROM_EMAIL = env_str("DJANGO_DEFAULT_FROM_EMAIL", "asteroid@localhost")
EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend" if EMAIL_HOST else "webapp.lib.logmail.LogBackend"
X_FRAME_OPTIONS = "DENY"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"refusals": {"()": "webapp.lib.logfilters.RefusalsInOneLine"}},
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env_str("ASTEROID_LOG_LEVEL", "INFO").upper()},
    # Django's own console handler (under DEBUG) printed each line a second time beside the root's
    "loggers": {
        "django": {"handlers": [], "propagate": True},
        "django.request": {"filters": ["refusals"]},
        # the e-mails of a site without a mail server, shown even by the Celery worker that logs at WARNING
        "webapp.lib.logmail": {"level": "INFO"},
    },
}
