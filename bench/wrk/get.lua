-- One fixed request (the URL and -H headers given to wrk), every status counted (common.lua).
dofile(os.getenv("WRK_LUA_DIR") .. "/common.lua")
