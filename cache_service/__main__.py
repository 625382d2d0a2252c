"""`python -m cache_service` is `kvcache-service`."""

import sys

from cache_service.cli import main

sys.exit(main())
