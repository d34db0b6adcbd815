"""An OpenEnv app whose module takes longer to import than a test's `startup_timeout_s`, as a server stuck
loading would: rollflow must stop waiting at the bound, stop the process and say so."""

import time

time.sleep(60)
