# Toy: a two-class set written for titans' tests (not a UCR set). 'rise' series climb, 'fall' series
# descend, each with a small wobble of its own.
@problemName Toy
@timeStamps false
@missing false
@univariate true
@equalLength true
@seriesLength 12
@classLabel true rise fall
@data
-1.467,-0.993,-0.787,-0.778,-0.71,-0.383,0.164,0.692,0.978,1.021,1.045,1.29:rise
1.837,1.312,0.763,0.432,0.36,0.352,0.151,-0.32,-0.891,-1.299,-1.433,-1.431:fall
-1.744,-1.585,-1.151,-0.578,-0.13,0.044,0.046,0.137,0.497,1.056,1.564,1.816:rise
1.35,1.337,1.276,0.962,0.42,-0.114,-0.412,-0.462,-0.482,-0.715,-1.21,-1.775:fall
-1.342,-0.999,-0.92,-0.914,-0.725,-0.263,0.309,0.729,0.872,0.871,0.988,1.379:rise
1.734,1.161,0.703,0.518,0.514,0.431,0.083,-0.472,-0.988,-1.252,-1.284,-1.318:fall
