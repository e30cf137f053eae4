-- One fixed request (the URL and -H headers given to wrk), at most one per `delay` ms per
-- connection (first argument): the lists of the mixed load.
dofile(os.getenv("WRK_LUA_DIR") .. "/common.lua")

local pause = 0

function init(args)
   pause = tonumber(args[1] or "0")
end

function delay()
   return pause
end
